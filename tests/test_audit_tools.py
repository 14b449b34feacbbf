"""What an adversarial audit of the converter, loading and traffic learning
found, one regression test each: bad input gets one clear error naming the
problem before any work, and a failed conversion leaves nothing behind."""

import json
import shutil

import pytest
import tiny

import dflash_mlx
from dflash_mlx.cli import main as cli_main
from dflash_mlx.errors import CheckpointError
from dflash_mlx.targets import TargetError


def convert(capsys, *args):
    """``mlx-dflash convert`` as users call it: exit code and stderr."""
    capsys.readouterr()
    rc = cli_main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


@pytest.fixture
def draft_src(qwen3_pair, tmp_path):
    return tiny.make_draft(tmp_path / "src", qwen3_pair.draft_config())


def test_a_drafter_of_another_hidden_size_is_refused_when_bound(qwen3_pair, tmp_path):
    """A drafter embeds its block with the target's table and scores with its
    head, so its width must be the target's. With ``target_hidden_size``
    naming the target's width its fc matched, and the drafter was accepted,
    then failed inside rms_norm at the first draft."""
    cfg = qwen3_pair.draft_config()
    width = cfg["hidden_size"]
    narrow = dict(cfg, hidden_size=width // 2, target_hidden_size=width, num_attention_heads=2, num_key_value_heads=1)
    path = tiny.make_draft(tmp_path / "narrow", narrow)
    with pytest.raises(TargetError, match=f"drafter hidden_size {width // 2} != target hidden size {width}"):
        dflash_mlx.load_draft(path, qwen3_pair.model)
    dflash_mlx.load_draft(path)  # alone it loads: nothing to compare with


@pytest.mark.parametrize(
    "index, message",
    [
        ('{"metadata": {}}', "index.json is damaged (no weight_map"),  # was a KeyError traceback
        ("not json", "index.json is damaged"),  # named no file
    ],
)
def test_a_damaged_shard_index_is_named(qwen3_pair, draft_src, tmp_path, capsys, index, message):
    (draft_src / "model.safetensors.index.json").write_text(index)
    rc, err = convert(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "out")
    assert rc == 1 and message in err and "Traceback" not in err, err
    with pytest.raises(CheckpointError, match="index.json is damaged"):
        dflash_mlx.load_draft(draft_src, qwen3_pair.model)


def test_a_config_that_is_not_an_object_is_named(qwen3_pair, draft_src, tmp_path, capsys):
    """A JSON list as config.json was an AttributeError traceback."""
    (draft_src / "config.json").write_text("[1, 2]")
    rc, err = convert(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "out")
    assert rc == 1 and "config.json must hold a JSON object" in err and "Traceback" not in err, err
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        dflash_mlx.load_draft(draft_src, qwen3_pair.model)


def test_kind_target_on_a_drafter_is_refused_up_front(draft_src, tmp_path, capsys):
    """It went to mlx-lm's converter, which built a qwen3 model and listed
    the drafter's 25 tensors as not in it, one per line."""
    rc, err = convert(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "out", "--kind", "target")
    assert rc == 1
    assert err.strip().splitlines() == [f"error: {draft_src} is a DFlash drafter (DFlashDraftModel), not a target: drop --kind target"]


def test_a_failed_conversion_leaves_no_directories_it_made(qwen3_pair, draft_src, tmp_path, capsys):
    tiny.damage(draft_src, "truncated")
    rc, err = convert(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "new" / "deep" / "out")
    assert rc == 1 and "truncated" in err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert convert(capsys, "--hf-path", draft_src, "--mlx-path", tmp_path / "mine" / "out")[0] == 1
    assert (tmp_path / "mine").is_dir()  # not made by the run: kept
    good = tiny.make_draft(tmp_path / "good", qwen3_pair.draft_config())
    assert convert(capsys, "--hf-path", good, "--mlx-path", tmp_path / "new" / "deep" / "out")[0] == 0
    assert (tmp_path / "new" / "deep" / "out" / "config.json").is_file()
    shutil.rmtree(tmp_path / "new")
    assert json.loads((good / "config.json").read_text())["hidden_size"] > 0


def test_a_restart_with_another_drafter_serves_that_drafter(qwen3_pair, tmp_path, caplog):
    """current.json (the last accepted drafter) was resumed whatever
    --draft-model the restarted server named: a restart that picked another
    drafter silently served the old line's adapted one."""
    from dflash_mlx.adapt import CURRENT, DRAFTERS, Adaptation
    from dflash_mlx.traffic import ADAPT_RESULT, Recorder

    first = qwen3_pair.make_draft(tmp_path / "first", block_size=4)
    other = qwen3_pair.make_draft(tmp_path / "other", seed=9, block_size=4)
    adapted = qwen3_pair.make_draft(tmp_path / "adapted", seed=2, block_size=4)
    (adapted / ADAPT_RESULT).write_text(json.dumps({"init_from": str(first.resolve()), "before": 1.0, "after": 2.0}))
    adaptation = Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, first)
    adaptation.offer(adapted)
    adaptation.swap(qwen3_pair.model, None)
    assert json.loads((tmp_path / "t" / DRAFTERS / CURRENT).read_text())["version"] == 1
    same = Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, first)  # the same flags continue
    assert (same.version, same.path) == (1, adapted.resolve())
    changed = Adaptation(Recorder(tmp_path / "t"), qwen3_pair.path, other)
    assert changed.path == other and changed.round_dir(changed.version + 1).name == "v2"
    assert "continues" in caplog.text
