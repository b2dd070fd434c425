"""Training and calibration data built from a corpus (label-free pairs, head examples, fits)."""
