"""Deprecated import path, kept so existing imports work: the checks now live in :mod:`ckptio.dcp.checks`."""

from .dcp.checks import box_problem, entry_problem, pickle_problem, tensor_problem, zip_problem

__all__ = ["box_problem", "entry_problem", "pickle_problem", "tensor_problem", "zip_problem"]
