"""Drafter architectures, one file per family: ``dflash`` (z-lab
``DFlashDraftModel``) and ``dflash2`` (``DFlash2DraftModel``, DFlash plus a
block convolution and a candidate selector)."""
