"""What each DFlash variant adds to the backbone: DSpark (dspark.py), DFlash2 (dflash2.py)."""
