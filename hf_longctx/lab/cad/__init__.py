"""CAD's research machinery: kernel profiles, launch-model fitting, recalibration and placement fits."""
