"""``python -m fsdp_lab <lab> ...`` — the same as the ``fsdp-lab`` command."""

from fsdp_lab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
