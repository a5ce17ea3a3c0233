"""The bottom layer, under ``models``: what every other layer uses and that needs nothing of
the package, nor torch. Files written atomically (``atomic``), the errors a user fixes and
how a command reports them (``errors``, weight-file errors included), and command-line flags
in both spellings (``flags``)."""
