"""The runtime's old place: bundles generated before ``hyper_parallel/runtime/`` existed
import ``hyper_parallel.codegen.runtime``; this name keeps them importable until they are
regenerated. New code and new bundles import ``hyper_parallel.runtime``."""

from hyper_parallel.runtime.apply import *  # noqa: F401,F403
from hyper_parallel.runtime.apply import hyper_apply_replacements, hyper_parallelize  # noqa: F401
