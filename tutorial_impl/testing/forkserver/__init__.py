"""Starting ranks fast: the harness's forkserver, its preload plan, what runs in it."""
