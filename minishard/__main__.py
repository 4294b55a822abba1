import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .cli import main


@record   # under torchrun, a failing rank's traceback lands in the failure summary
def _entry() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(_entry())
