"""The bottom layer, under ``models``: what every other layer uses and that needs nothing of
the package, nor torch (atomic files, the errors a user fixes, command-line flags, how a
process exits). Module by module: docs/modules.md."""
