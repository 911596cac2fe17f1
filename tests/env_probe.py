"""`python -m tests.env_probe NAME...`: prints the named environment variables as JSON (a
fresh interpreter's view of what it was started with)."""

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}))
