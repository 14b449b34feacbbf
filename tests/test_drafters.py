"""Drafters found by the target's name: z-lab's published table, offline."""

import re

import pytest

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.drafters import KNOWN_DRAFTERS, base_name, known_drafter
from dflash_mlx.pair import resolve_pair

ENTRIES = sorted(KNOWN_DRAFTERS.items())


@pytest.mark.parametrize("target, drafter", ENTRIES, ids=[t for t, _ in ENTRIES])
def test_every_entry_resolves_by_its_id_name_and_quantized_exports(target, drafter):
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", target) and drafter.startswith("z-lab/")
    name = target.split("/")[1]
    assert dflash_mlx.known_drafter(target) == drafter
    for export in (f"mlx-community/{name}-4bit", f"mlx-community/{name.lower()}-8bit", f"someone/{name}-MLX-bf16",
                   f"mlx-community/{name}-4bit-DWQ", f"/models/{name}-mxfp4/", name):
        assert known_drafter(export) == drafter, export


def test_the_families_and_both_drafter_kinds_are_there():
    drafters = set(KNOWN_DRAFTERS.values())
    for family in ("Qwen3-", "Qwen3.5-", "Qwen3.6-", "Qwen3.8-", "Qwen3-Coder-Next", "gemma4-", "gemma-4-",
                   "gpt-oss-", "Kimi-K2.5"):
        assert any(d.startswith("z-lab/" + family) for d in drafters), family
    assert any(d.endswith("-DFlash2") for d in drafters) and any(d.endswith("-DFlash") for d in drafters)
    # no two targets share a base name (each export resolves one way)
    assert len({base_name(t) for t in KNOWN_DRAFTERS}) == len(KNOWN_DRAFTERS)


@pytest.mark.parametrize(
    "target",
    [
        "my-org/my-model",
        "Qwen/Qwen3-4B-Instruct-2507",  # another model than Qwen3-4B
        "mlx-community/Qwen3-4B-Base-4bit",
        "mlx-community/Qwen3.5-4B-abliterated-4bit",
        "Qwen/Qwen3.5-4",
        "4bit",
        "",
    ],
)
def test_unknown_names_have_no_drafter(target):
    assert known_drafter(target) is None


@pytest.mark.parametrize(
    "export, drafter",
    [
        ("mlx-community/gpt-oss-20b-MXFP4-Q8", "z-lab/gpt-oss-20b-DFlash"),
        ("lmstudio-community/gpt-oss-120b-MLX-8bit", "z-lab/gpt-oss-120b-DFlash"),
        ("mlx-community/Qwen3-Coder-Next-4bit", "z-lab/Qwen3-Coder-Next-DFlash"),
        ("mlx-community/Kimi-K2.5-MLX-3.6bit", "z-lab/Kimi-K2.5-DFlash"),
    ],
)
def test_community_exports_of_the_new_families_resolve(export, drafter):
    """The export names of the gpt-oss, Qwen3-Next and Kimi MLX exports:
    MXFP4 with 8-bit rest ("-MXFP4-Q8"), fractional bit widths."""
    assert known_drafter(export) == drafter


def test_a_local_export_resolves_through_its_directory_name(tmp_path):
    target = tmp_path / "Qwen3.5-4B-4bit"
    assert resolve_pair(str(target)) == (str(target), "z-lab/Qwen3.5-4B-DFlash")
    assert resolve_pair(str(target), "my/drafter") == (str(target), "my/drafter")


def test_an_unknown_target_without_draft_model_is_one_error_naming_the_known(tmp_path, capsys):
    model = str(tmp_path / "my-model")  # refused before anything is read
    assert cli.main(["generate", "--model", model]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no known drafter for {model}: pass --draft-model")
    assert all(t in err for t in KNOWN_DRAFTERS) and "mlx-community/Qwen3.5-4B-4bit" in err
