"""The tpu job's tables from its rows: the h100 job's, for the TPU chip its ``rates`` row names."""

from benchmarks.tables.h100 import POINT as POINT
from benchmarks.tables.h100 import tables as tables
