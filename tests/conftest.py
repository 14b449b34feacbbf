import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# Lossless checks compare float32 arithmetic with mlx-lm's own decode.
mx.set_default_device(mx.cpu)


class Pair:
    """A tiny target on disk, loaded through mlx-lm, plus its draft config."""

    def __init__(self, root: Path, base: dict, seed: int = 0):
        from mlx_lm import load

        self.base = base
        self.path = tiny.make_target(root / base["model_type"], base, seed=seed)
        self.model, self.tokenizer = load(str(self.path))
        self.vocab = self.model.model.embed_tokens.weight.shape[0]

    def draft_config(self, **kw) -> dict:
        return tiny.draft_config(self.base, self.vocab, **kw)

    def make_draft(self, path: Path, seed: int = 1, **kw) -> Path:
        return tiny.make_draft(path, self.draft_config(**kw), seed=seed)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("qwen3"), tiny.QWEN3)


@pytest.fixture(scope="session")
def qwen3_5_pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("qwen3_5"), tiny.QWEN3_5)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("llama"), tiny.LLAMA)


@pytest.fixture(params=["qwen3", "qwen3_5"])
def pair(request):
    return request.getfixturevalue(f"{request.param}_pair")
