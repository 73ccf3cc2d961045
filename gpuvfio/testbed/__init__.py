"""Comparison testbeds: the same guest as passthrough / vGPU / bare-metal variants,
measured the same way and reported side by side (gpuvfio testbed plan|run|report)."""
