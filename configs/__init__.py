"""The runnable experiment configs, a package as T5X's are.

Being a package (each folder with an `__init__.py`) is what gin's package-path reader needs:
with the project root on `sys.path` (`python -m ...` from it), gin resolves an include such as
'configs/diamante/tiny_cpu.gin' that is not under the working directory as a file of the
package `configs.diamante`, and a folder without `__init__.py` would be a namespace package,
which that reader cannot read.
"""
