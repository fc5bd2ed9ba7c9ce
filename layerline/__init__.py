"""layerline: distributed LLM inference over gRPC.

The root package holds only what every process kind shares and none of them owns: the command
line and the local model store. It never imports torch at import time.
"""

__version__ = "0.1.0"
