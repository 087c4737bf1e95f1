"""The torchtitan registries: the library's one entry for users and ``with_ucp``; the tests' fixtures under
``--module ucp_dev.testing``; the one CPU-sized deepseek_v3 at its two sizes. Single process, configs only."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torchtitan")
from helpers import skip_unless_torchtitan_runs  # noqa: E402

skip_unless_torchtitan_runs()

from ucp_dcp import UCPError  # noqa: E402
from ucp_dcp.torchtitan import GlobalCursorTextDataLoader, UCPCheckpointManager  # noqa: E402
from ucp_dcp.torchtitan import config_registry as library  # noqa: E402
from ucp_dcp.torchtitan.job import parse_job  # noqa: E402
from ucp_dcp.torchtitan.mappings import hf_mapping  # noqa: E402
from ucp_dev.testing import config_registry as fixtures  # noqa: E402
from ucp_dev.testing.titan_models import DSV3_HF, DSV3_SMALL  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_the_library_registry_holds_the_users_entry_only():
    assert library.__all__ == ["llama3_debugmodel_ucp", "with_ucp"]
    cfg = library.llama3_debugmodel_ucp()
    assert isinstance(cfg.checkpoint, UCPCheckpointManager.Config)
    assert isinstance(cfg.dataloader, GlobalCursorTextDataLoader.Config)


def test_the_fixtures_resolve_under_one_module():
    """Every fixture entry is a config function of ``--module ucp_dev.testing``; ``*_ucp`` ones turn the option on."""
    for name in fixtures.__all__:
        cfg = getattr(fixtures, name)()
        assert isinstance(cfg.checkpoint, UCPCheckpointManager.Config) == name.endswith("_ucp"), name
    cfg = parse_job(["--module", "ucp_dev.testing", "--config", "deepseek_v3_small_mtp_ucp"], hint="")
    assert isinstance(cfg.checkpoint, UCPCheckpointManager.Config) and cfg.model_spec.model.mtp_layers


def test_one_deepseek_definition_two_sizes():
    """``DSV3_HF`` differs from the Trainer's size only where the HF tests need it; HF's mapping takes
    the Trainer's size with HF's latent eps (``deepseek_v3_small_hf``) and refuses torchtitan's default."""
    differ = {f.name for f in dataclasses.fields(DSV3_SMALL) if getattr(DSV3_SMALL, f.name) != getattr(DSV3_HF, f.name)}
    assert differ == {
        "n_layers",
        "q_lora_rank",
        "mscale",
        "dense_hidden_dim",
        "num_shared_experts",
        "vocab_size",
        "rope_max_seq_len",
        "rope_factor",
        "rope_original_seq_len",
        "latent_eps",
    }
    assert hf_mapping(fixtures.deepseek_v3_small_hf().model_spec.model).config["n_shared_experts"] == 2
    with pytest.raises(UCPError, match="kv_norm eps"):
        hf_mapping(fixtures.deepseek_v3_small().model_spec.model)
