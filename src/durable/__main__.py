"""``python -m durable``: the same as the ``durable`` command (see durable.cli)."""

from durable.cli import main

if __name__ == "__main__":
    main()
