import sys

from hyper_parallel.codegen.cli import main
from hyper_parallel.codegen.stages import keep_until_exit

status = main()
keep_until_exit()
sys.exit(status)
