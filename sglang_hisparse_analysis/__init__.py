"""Hot-buffer replacement policies and a numpy simulator to measure them on selection traces."""
