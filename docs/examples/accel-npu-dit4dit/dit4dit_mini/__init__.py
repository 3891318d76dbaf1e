"""A stand-in for a DiT4DiT-style repository's own code (the part that has the bug).

Like the real repo it imports torch at package import, so accel-npu is active before any of its
modules is imported.
"""

import torch  # noqa: F401 - imported for its effect: accel-npu activates first

__version__ = "0.1.0"
