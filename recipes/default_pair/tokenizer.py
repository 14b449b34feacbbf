"""Stage ``tokenizer``: a byte-level BPE (with ``<|mask|>``) trained on the
train split, checked through transformers; and the splits encoded with it."""

import json
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .common import EOS_TOKEN, MASK_TOKEN, read_split, stdlib_root


def stage_tokenizer(args) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    work = Path(args.work_dir)
    root = stdlib_root()
    train = read_split(work, "train")
    held = read_split(work, "heldout")

    tok = Tokenizer(models.BPE())
    # ByteLevel maps every byte to a symbol, so any text (tabs, newlines,
    # non-ASCII) encodes and decodes back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [(root / r).read_text(encoding="utf-8") for r in train]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    out = work / "tokenizer"
    if out.exists():
        shutil.rmtree(out)
    for stale in work.glob("tokens_*.npy"):  # encoded with the old tokenizer
        stale.unlink()
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 65536,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN}, indent=2) + "\n"
    )

    # Check through transformers, the way mlx_lm.load will read it.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    mask_ids = hf.encode(MASK_TOKEN, add_special_tokens=False)
    assert len(mask_ids) == 1 and mask_ids[0] == hf.mask_token_id, mask_ids
    assert hf.chat_template is None
    n_bytes = n_toks = 0
    for rel in tqdm(held, desc="round-trip held-out"):
        text = (root / rel).read_text(encoding="utf-8")
        ids = hf.encode(text, add_special_tokens=False)
        back = hf.decode(ids)
        if back != text:
            raise SystemExit(f"tokenizer round-trip failed on {rel}")
        n_bytes += len(text.encode("utf-8"))
        n_toks += len(ids)
    info = {
        "vocab_size": len(hf),  # includes the special tokens
        "eos_token_id": hf.eos_token_id,
        "mask_token_id": hf.mask_token_id,
        "heldout_bytes_per_token": round(n_bytes / n_toks, 3),
    }
    (out / "tokenizer_meta.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))



def encode_split(work: Path, name: str) -> np.ndarray:
    """All files of a split as one token stream, files separated by EOS."""
    cache = work / f"tokens_{name}.npy"
    if cache.exists():
        return np.load(cache)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    root = stdlib_root()
    texts = [(root / r).read_text(encoding="utf-8") for r in read_split(work, name)]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    stream = []
    for e in encs:
        stream.extend(e.ids)
        stream.append(eos)
    arr = np.asarray(stream, dtype=np.uint16)
    np.save(cache, arr)
    return arr

