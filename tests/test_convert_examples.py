"""The converter's runnable examples in convert/ run as their guide says."""

import runpy
from pathlib import Path

CONVERT = Path(__file__).resolve().parents[1] / "convert"


def test_quantize_drafter_keeps_the_bundled_pairs_text(tmp_path, capsys):
    main = runpy.run_path(str(CONVERT / "quantize_drafter.py"))["main"]
    out = tmp_path / "draft-8bit"
    assert main(["--bits", "8", "--max-tokens", "8", "--mlx-path", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "same text with both drafters" and "8-bit drafter:" in lines[-2]
    config = (out / "config.json").read_text()
    assert '"bits": 8' in config  # kept where asked, quantized
