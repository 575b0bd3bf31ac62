"""vLLM plugin for speculative decoding of NVIDIA Nemotron 3.5 Lightning with its DFlash / DSpark drafts.

Importing this package is cheap: vLLM and torch are imported only by the modules that need them.
"""

__version__ = "0.1.0"
