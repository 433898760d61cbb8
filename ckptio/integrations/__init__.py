"""Plug-ins for training frameworks, one module each, imported only by name (``import ckptio`` imports
none of them, nor the framework): :mod:`ckptio.integrations.lightning`.
"""
