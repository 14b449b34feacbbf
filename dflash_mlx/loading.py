"""Loading targets (through mlx-lm) and drafters (z-lab Hugging Face layout).

The rules every reader of a checkpoint shares live here once: where a path or
hub id points, how config.json is read, which configs are drafters, and how
drafter tensors are named and cast.
"""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .errors import CheckpointError, CheckpointNotFoundError
from .models.dflash import MAX_POSITIONS, DFlashConfig, DFlashDraftModel, DraftConfigError, real, whole

DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")

# Some community drafters name tensors differently; the names on the right
# are z-lab's (github.com/z-lab/dflash, dflash/model.py).
TENSOR_ALIASES = (
    ("midlayer.", "layers.0."),
    ("encoder.fc.", "fc."),
    ("encoder.output_norm_enc.", "hidden_norm."),
    ("model.", ""),
)
# DFlash2 stores its selector codebooks as bare tensors ("..._codebook");
# as MLX embeddings they are "..._codebook.weight".
CODEBOOK = "_codebook"


# What mx.quantize takes (affine mode).
QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
QUANTIZED_GROUP_SIZES = (32, 64, 128)


class DraftLoadError(CheckpointError):
    """A drafter directory that cannot be loaded as it is."""


def local_checkpoint(path_or_hub_id: Union[str, Path]) -> Optional[Path]:
    """The local directory ``path_or_hub_id`` names, or None for a hub id."""
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{path} is a file; pass the checkpoint directory")
        return path
    text = str(path_or_hub_id)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointNotFoundError(
            f"{text!r} is neither an existing directory nor a Hugging Face id (owner/name)"
        )
    return None


def resolve_path(path_or_hub_id: Union[str, Path], allow_patterns=None) -> Path:
    """A local directory as it is, else a Hugging Face snapshot.

    huggingface_hub honours HF_HUB_OFFLINE and its cache, so an id that was
    downloaded once keeps working offline.
    """
    path = local_checkpoint(path_or_hub_id)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    text = str(path_or_hub_id)
    try:
        return Path(
            snapshot_download(
                text,
                allow_patterns=allow_patterns
                or ["*.json", "*.safetensors", "*.md", "tokenizer*", "*.txt", "*.jinja"],
            )
        )
    except LocalEntryNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{text!r} is not a local directory and is not in the Hugging Face cache "
            f"(offline or unreachable hub): download it once or pass a local path"
        ) from e
    except HfHubHTTPError as e:
        raise CheckpointNotFoundError(f"cannot download {text!r} from the Hugging Face hub: {e}") from e


def read_config(path: Path) -> dict:
    """``path/config.json`` as a dict."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object, not {type(cfg).__name__}: not a Hugging Face config")
    return cfg


def draft_architecture(cfg: dict) -> Optional[str]:
    """The drafter architecture a config.json describes, or None for any other model.

    Early z-lab configs name no architecture but carry a ``dflash_config``.
    """
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"config.json's architectures must be a list of class names, not {archs!r}")
    arch = archs[0] if archs else None
    if arch is None and "dflash_config" in cfg:
        return "DFlashDraftModel"
    return arch if arch in DRAFT_ARCHITECTURES else None


def check_draft_architecture(cfg: dict, path) -> str:
    arch = draft_architecture(cfg)
    if arch is None:
        found = (cfg.get("architectures") or [None])[0]  # a list of names (draft_architecture checked)
        raise DraftLoadError(
            f"{path}: architecture {found!r} is not a DFlash drafter; supported: "
            f"{', '.join(DRAFT_ARCHITECTURES)}"
        )
    return arch


def index_files(index: Path) -> list:
    """The shard file names ``model.safetensors.index.json`` maps tensors to."""
    try:
        files = json.loads(index.read_text())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DraftLoadError(
            f"{index} is damaged (no weight_map of tensor -> file; {type(e).__name__}: {e}): "
            "download it again, or delete it to load every *.safetensors file"
        ) from e
    if not all(isinstance(f, str) and f for f in files):
        raise DraftLoadError(f"{index}: weight_map must map tensor names to file names; download it again")
    return list(files)


def read_safetensors(path: Path) -> Dict[str, mx.array]:
    """All tensors of a single-file or sharded (indexed) checkpoint."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(index_files(index)))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise DraftLoadError(f"{path} has no .safetensors weights")
    weights = {}
    for name in files:
        f = path / name
        if not f.exists():
            raise DraftLoadError(f"{f} is listed in the index but missing")
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError on bad files
            raise DraftLoadError(f"{f} is truncated or corrupt ({e}); download it again") from e
    return weights


def model_tensor_name(stored: str) -> str:
    """Checkpoint tensor name -> the drafter's parameter name."""
    for old, new in TENSOR_ALIASES:
        if stored.startswith(old):
            stored = new + stored[len(old) :]
            break
    return stored + ".weight" if stored.endswith(CODEBOOK) else stored


def stored_tensor_name(name: str) -> str:
    """The drafter's parameter name -> its z-lab checkpoint name."""
    suffix = CODEBOOK + ".weight"
    return name[: -len(".weight")] if name.endswith(suffix) else name


def normalize_tensor_names(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    return {model_tensor_name(key): value for key, value in weights.items()}


def casts_to(name: str, value: mx.array, dtype: mx.Dtype) -> bool:
    """Whether asking for ``dtype`` casts this tensor.

    Floating tensors only (packed quantized weights are integers). DFlash2's
    selector codebooks keep their stored precision unless float32 is asked
    for: selector scores are sums of their products.
    """
    if not mx.issubdtype(value.dtype, mx.floating):
        return False
    return dtype == mx.float32 or CODEBOOK not in name


def draft_model_class(config: DFlashConfig):
    if config.architecture == "DFlash2DraftModel":
        from .models.dflash2 import DFlash2DraftModel

        return DFlash2DraftModel
    return DFlashDraftModel


def quantization_of(cfg: dict, path) -> Optional[dict]:
    """config.json's ``quantization`` entry (mlx-lm's layout), checked."""
    q = cfg.get("quantization")
    if q is None:
        return None
    ok = isinstance(q, dict) and all(
        isinstance(q.get(k), int) and not isinstance(q.get(k), bool) for k in ("group_size", "bits")
    )
    if not ok or q["bits"] not in QUANTIZED_BITS or q["group_size"] not in QUANTIZED_GROUP_SIZES:
        raise DraftLoadError(
            f"{path}/config.json: quantization {q!r} is not one MLX can load: it needs bits in "
            f"{QUANTIZED_BITS} and group_size in {QUANTIZED_GROUP_SIZES} (convert again with mlx-dflash convert -q)"
        )
    return q


def build_draft(config: DFlashConfig, quantization: Optional[dict] = None, weights=None):
    model = draft_model_class(config)(config)
    if quantization:
        names = weights or {}
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in names,
        )
    return model


def check_weights(model: nn.Module, weights: Dict[str, mx.array], path) -> None:
    """Exactly the model's tensors, with the model's shapes."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        raise DraftLoadError(f"{path}: tensors do not match the config: {'; '.join(parts)}")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise DraftLoadError(
                f"{path}: tensor {name} has shape {tuple(value.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )


def load_draft(
    path_or_hub_id: Union[str, Path],
    target=None,
    *,
    dtype: Optional[mx.Dtype] = None,
) -> DFlashDraftModel:
    """Load a DFlash / DFlash2 drafter from a z-lab style checkpoint.

    Accepts the original Hugging Face directory, a hub id, or a directory
    written by ``dflash_mlx convert`` (quantized ones need no extra flag).
    When ``target`` is given the drafter is checked against it and bound.
    ``dtype`` casts floating weights (default: as stored).
    """
    path = resolve_path(path_or_hub_id)
    cfg = read_config(path)
    check_draft_architecture(cfg, path)
    try:
        config = DFlashConfig.from_hf(cfg)
    except DraftConfigError as e:
        raise DraftLoadError(f"{path}/config.json: {e}") from e
    weights = normalize_tensor_names(read_safetensors(path))
    model = build_draft(config, quantization_of(cfg, path), weights)
    check_weights(model, weights, path)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.update(
            tree_map_with_path(
                lambda name, v: v.astype(dtype) if casts_to(name, v, dtype) else v,
                model.parameters(),
            )
        )
    model.eval()
    mx.eval(model.parameters())
    if target is not None:
        model.bind(target)
    return model


# Target config.json fields mlx-lm reads as sizes and as positive reals.
TARGET_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "head_dim", "sliding_window",
)  # fmt: skip
TARGET_REALS = ("rms_norm_eps", "rope_theta", "layer_norm_eps")


def check_target_config(cfg: dict, path) -> None:
    """Refuse the config.json values mlx-lm would fail on deep inside (or
    build absurd models from), naming the field; ``text_config`` too."""
    where = f"{path}/config.json"
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where} must hold a JSON object")
    if not isinstance(cfg.get("model_type"), str):
        raise CheckpointError(f"{where}: model_type must name an mlx-lm model family, not {cfg.get('model_type')!r}")
    for section in (cfg, cfg.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in TARGET_SIZES:
            if section.get(key) is not None:
                whole(f"{where}: {key}", section[key], 1, error=CheckpointError)
        if section.get("max_position_embeddings") is not None:
            whole(f"{where}: max_position_embeddings", section["max_position_embeddings"], 1, MAX_POSITIONS, CheckpointError)
        for key in TARGET_REALS:
            if section.get(key) is not None:
                real(f"{where}: {key}", section[key], 0, error=CheckpointError)
    for key in ("text_config", "rope_scaling", "quantization"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise CheckpointError(f"{where}: {key} must be an object, not {cfg[key]!r}")


def load(path_or_hub_id: Union[str, Path], **kwargs) -> Tuple[nn.Module, object]:
    """Load a target model and tokenizer with mlx-lm (local path or hub id).

    A local checkpoint's config.json is checked first; what mlx-lm still
    refuses while building the model from it comes back as a CheckpointError.
    """
    from mlx_lm import load as mlx_lm_load

    path = local_checkpoint(path_or_hub_id)
    if path is None:
        return mlx_lm_load(str(path_or_hub_id), **kwargs)
    from huggingface_hub.errors import StrictDataclassError  # transformers' config checks

    check_target_config(read_config(path), path)
    try:
        return mlx_lm_load(str(path_or_hub_id), **kwargs)
    except (
        ValueError, TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError,
        AssertionError,  # mlx-lm's ModelArgs assert some fields
        StrictDataclassError,
    ) as e:  # fmt: skip
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"{path}: mlx-lm cannot build the model its config.json describes ({type(e).__name__}: {e}); "
            "fix config.json or convert the checkpoint again"
        ) from e
