"""The generated cosystream.v1 wire API (``scripts/gen_protos.py``; do not edit the generated modules)."""
