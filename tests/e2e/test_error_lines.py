"""One mistake under torchrun, counted as the user sees it (issue 47): an FSDP2 job (embedding, 4 MLP blocks,
a head, AdamW) saved at 2 ranks and loaded at 4 with one layer kind resized (ffn 32 -> 40), the error left
uncaught. Rank 0 prints the problem in full; every other rank prints one line naming it.

Before: 26 lines a rank, 104 in all at 4 ranks (each rank's whole error); then 39 (rank 0 in full, 15 lines,
and 8 a rank for the others' tracebacks down to ``ucp_dcp.load``); now 18. torchrun's own summary is not counted
(its lines carry no ``[rankN]:`` prefix).
"""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

JOB = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ucp_dcp


def build(ffn):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, ffn), nn.GELU(), nn.Linear(ffn, 16)) for _ in range(4)]
    model = nn.Sequential(nn.Embedding(64, 16), *blocks, nn.Linear(16, 64))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


dist.init_process_group("gloo")
mode, root = sys.argv[1], sys.argv[2]
model = build(32 if mode == "save" else 40)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
if mode == "save":
    model(torch.randint(0, 64, (4, 8))).sum().backward()
    optim.step()
msd, osd = get_state_dict(model, optim)
(ucp_dcp.save if mode == "save" else ucp_dcp.load)({"model": msd, "optim": osd}, root)
dist.destroy_process_group()
"""

RANK_LINE = re.compile(r"^\[rank(\d+)\]: (.*)$")


def _torchrun(world: int, *args: str, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "job.py"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_resized_layer_at_four_ranks_prints_one_full_error_and_one_line_per_other_rank(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    saved = _torchrun(2, "save", "ck", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    out = _torchrun(4, "load", "ck", cwd=tmp_path)
    assert out.returncode != 0, out
    lines: dict[int, list[str]] = {}
    for line in out.stderr.splitlines():
        if m := RANK_LINE.match(line):
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
    text = out.stderr[-6000:]
    assert sorted(lines) == [0, 1, 2, 3], text
    full = "\n".join(lines[0])
    assert "ucp_dcp.errors.ShapeMismatchError: Size mismatch" in full and "hint: load into a model built" in full, text
    for rank in (1, 2, 3):
        assert len(lines[rank]) == 1, (rank, lines[rank])
        assert lines[rank][0].startswith(
            "ucp_dcp.errors.PeerShapeMismatchError: the same as rank 0, which prints it in full: ShapeMismatchError:"
        ), lines[rank]
    assert sum(map(len, lines.values())) <= 25, text  # 39 before the one-line peers, 104 before issue 47
