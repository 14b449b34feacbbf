"""Interactive chat with a target + DFlash drafter (mlx_lm.chat's manner).

    mlx-dflash chat --model Qwen/Qwen3.5-4B --draft-model z-lab/Qwen3.5-4B-DFlash

Type 'q' to quit, 'r' to reset the conversation. Targets without a chat
template (the bundled code model) continue the running text instead.
"""

import argparse
import sys

from .generate import stream_generate


def setup_arg_parser():
    from .pair import DEFAULT_TARGET

    p = argparse.ArgumentParser(description="Chat with a target model, drafted by DFlash.")
    p.add_argument("--model", default=str(DEFAULT_TARGET))
    p.add_argument("--draft-model", default=None)
    p.add_argument("--max-tokens", "-m", type=int, default=512)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--system-prompt", default=None)
    return p


def main(argv=None, input_fn=input):
    from .pair import load_pair

    args = setup_arg_parser().parse_args(argv)
    try:
        model, tokenizer, draft, _ = load_pair(args.model, args.draft_model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    templated = bool(getattr(tokenizer, "chat_template", None))
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages, transcript = list(system), ""
    print("[q quits, r resets]" + ("" if templated else " [no chat template: text continuation]"))
    while True:
        try:
            query = input_fn(">> ")
        except EOFError:
            break
        if query.strip() == "q":
            break
        if query.strip() == "r":
            messages, transcript = list(system), ""
            continue
        if templated:
            messages.append({"role": "user", "content": query})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            transcript += query + "\n"
            prompt = transcript
        reply, cycles, committed = "", 0, 0
        for r in stream_generate(
            model, draft, tokenizer, prompt,
            block_size=args.block_size, max_tokens=args.max_tokens, temperature=args.temp,
        ):
            print(r.text, end="", flush=True)
            reply += r.text
            cycles += 1
            committed += r.committed
        print(f"\n[{r.generation_tps:.1f} tok/s, {(committed - 1) / max(1, cycles - 1):.2f} tokens/cycle]")
        if templated:
            messages.append({"role": "assistant", "content": reply})
        else:
            transcript += reply
    return 0


if __name__ == "__main__":
    sys.exit(main())
