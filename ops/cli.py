"""The `ops` command. The stack commands (plan, up, down, status, health, ...) land with the ops issue."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("ops: the stack commands (plan, up, down, status, health) are not built yet; "
          "run the backend with: python -m backend generate --model smollm2 'prompt'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
