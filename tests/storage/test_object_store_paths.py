"""The other ways onto an object store (issue 35): an asynchronous save in DCP's checkpoint *process* to
s3:// (moto's server on 127.0.0.1), loaded bitwise; Hugging Face folders, which live on local folders only:
an export *from* an s3:// checkpoint to a local folder works bitwise, an s3:// HF folder is refused with a
UCPError that says so (not "no checkpoint")."""

from __future__ import annotations

import dist as D
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ucp_dcp
from ucp_dcp.errors import UCPError
from ucp_dcp.sources.hf.mapping import HFMapping, HFRule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FULL = torch.arange(48.0).reshape(8, 6)


def _async_process_worker(rank, world, env, url):
    for k, v in env.items():
        D.setenv(k, v)
    group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), "step": torch.tensor(7)}
    ucp_dcp.async_save(sd, url, process_group=group, async_checkpointer_type="process").result()
    return "ok"


def _load_worker(rank, world, env, url):
    for k, v in env.items():
        D.setenv(k, v)
    target = {"w": torch.zeros(8, 6), "step": torch.tensor(0)}
    ucp_dcp.load(target, url)
    return torch.equal(target["w"], FULL) and int(target["step"]) == 7


@pytest.mark.full  # 16 s here, most of it DCP's checkpoint process starting; make test has the local case
def test_an_async_save_in_dcps_checkpoint_process_to_s3_loads_bitwise(s3):
    """The writer (with its store client and ``storage_options``) is pickled into DCP's background process,
    which uploads and commits there; the prefix then holds our commit (sidecar + ``.metadata``)."""
    assert D.run(_async_process_worker, 2, s3.env(), s3.prefix) == ["ok", "ok"]
    from ucp_dcp.storage.opening import open_path

    assert open_path(s3.prefix)[1].status == "verified"  # our sidecar: the checksums and the commit are ours
    assert D.run(_load_worker, 1, s3.env(), s3.prefix) == [True]


def test_an_hf_export_from_an_s3_checkpoint_to_a_local_folder_is_bitwise(s3, tmp_path):
    from safetensors.torch import load_file

    from ucp_dcp.sources.hf.publish import export_hf

    w = torch.randn(4, 6)
    ucp_dcp.save({"net.w": w}, s3.prefix)
    export_hf(s3.prefix, tmp_path / "hf", HFMapping((HFRule("w", "net.w"),)))
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], w)


@pytest.mark.parametrize("side", ["load", "export"])
def test_an_hf_folder_on_a_store_is_refused_as_such(side, tmp_path):
    from ucp_dcp.sources.hf import load_hf
    from ucp_dcp.sources.hf.publish import export_hf

    m = HFMapping((HFRule("w", "net.w"),))
    with pytest.raises(UCPError, match=r"local \(or mounted\) folders only, not s3://") as e:
        if side == "load":
            load_hf({"net.w": torch.zeros(2)}, "s3://bucket/hf", m)
        else:
            ucp_dcp.save({"net.w": torch.zeros(2)}, tmp_path / "c")
            export_hf(tmp_path / "c", "s3://bucket/hf", m)
    assert "aws s3 sync" in str(e.value)
