"""Bundled hardware profiles (YAML): `--hardware NAME` resolves to NAME.yaml in this folder."""
