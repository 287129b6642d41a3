"""cellm: fast inference of small language models on ordinary hardware."""
