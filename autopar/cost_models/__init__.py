"""Cost models: compute (roofline with calibrated efficiencies), memory and communication."""
