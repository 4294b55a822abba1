import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .cli import main


@record   # (main writes torchrun's error file itself, as one line; this catches what escapes it)
def _entry() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(_entry())
