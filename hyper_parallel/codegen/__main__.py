import sys

from hyper_parallel.codegen.cli import main

sys.exit(main())
