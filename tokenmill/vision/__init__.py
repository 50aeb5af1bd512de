"""Image input: what a prompt's images are on the host (`inputs`), and how image bytes become
pixel patches (`images`, transformers' image processor)."""
