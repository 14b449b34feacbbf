"""The bundled default pair: a small trained Qwen3.5-architecture target and
its DFlash drafter, shipped inside the package so everything runs offline."""

import json
from pathlib import Path
from typing import List, Optional

PAIR_DIR = Path(__file__).parent / "default_pair"
DEFAULT_TARGET = PAIR_DIR / "target"
DEFAULT_DRAFT = PAIR_DIR / "draft"
DEFAULT_PROMPTS = PAIR_DIR / "prompts.json"


def draft_config_for_target(
    target_args,
    *,
    num_layers: int = 2,
    block_size: int = 16,
    target_layer_ids: Optional[List[int]] = None,
    mask_token_id: int,
    intermediate_size: Optional[int] = None,
) -> dict:
    """A z-lab style drafter config.json sized to ``target_args`` (mlx-lm args)."""
    from .models.dflash import default_target_layer_ids

    hidden = int(target_args.hidden_size)
    n_target = int(target_args.num_hidden_layers)
    heads = int(target_args.num_attention_heads)
    head_dim = int(getattr(target_args, "head_dim", None) or hidden // heads)
    taps = target_layer_ids or default_target_layer_ids(n_target, num_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or int(target_args.intermediate_size),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target_args, "num_key_value_heads", heads)),
        "head_dim": head_dim,
        "vocab_size": int(target_args.vocab_size),
        "rms_norm_eps": float(target_args.rms_norm_eps),
        "rope_theta": 10000.0,
        "max_position_embeddings": int(getattr(target_args, "max_position_embeddings", 4096)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": int(mask_token_id)},
    }


def default_draft_for(model_path) -> str:
    """The drafter that goes with ``model_path`` when the user names none."""
    if Path(str(model_path)).resolve() != DEFAULT_TARGET.resolve():
        raise ValueError("--draft-model is required when --model is not the bundled default target")
    if not (DEFAULT_DRAFT / "config.json").exists():
        raise FileNotFoundError(
            f"the bundled drafter is missing at {DEFAULT_DRAFT}; rebuild it with "
            "`python recipes/build_default_pair.py --stage drafter`"
        )
    return str(DEFAULT_DRAFT)


def default_prompts() -> List[str]:
    return json.loads(DEFAULT_PROMPTS.read_text())


def default_prompt() -> str:
    prompts = default_prompts()
    return prompts[0] if prompts else "def "


def load_pair(model_path, draft_path=None):
    """Target, tokenizer and bound drafter for the CLIs; the drafter defaults
    to the bundled one when the target is the bundled one."""
    from .loading import load, load_draft

    draft_path = draft_path or default_draft_for(model_path)
    model, tokenizer = load(model_path)
    return model, tokenizer, load_draft(draft_path, model), draft_path
