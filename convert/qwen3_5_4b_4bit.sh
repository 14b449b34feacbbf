#!/usr/bin/env bash
# A 4-bit Qwen3.5-4B and its z-lab drafter, converted in one command, then run.
# Needs the Hugging Face hub (about 9 GB of downloads) and leaves two directories
# here: qwen3.5-4b-4bit and qwen3.5-4b-dflash-4bit. See convert/README.md.
set -euo pipefail

mlx-dflash convert \
    --hf-path Qwen/Qwen3.5-4B --mlx-path qwen3.5-4b-4bit \
    --draft-hf-path z-lab/Qwen3.5-4B-DFlash --draft-mlx-path qwen3.5-4b-dflash-4bit \
    -q --q-bits 4 --q-group-size 64

mlx-dflash generate --model qwen3.5-4b-4bit --draft-model qwen3.5-4b-dflash-4bit \
    --prompt "Write a quicksort in Python." --max-tokens 256
