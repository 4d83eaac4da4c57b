"""edgetl: fine-tune a pretrained vision model on the edge inside a hard memory budget."""

__version__ = "0.1.0"
