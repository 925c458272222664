from gpuwait.cli import entry_point

entry_point()
