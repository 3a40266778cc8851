"""The goodput table's cells, shared by goodput_table.py and goodput_sensitivity.py."""

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
COLUMNS = (  # (label, method, learners)
    ("DP", "dp", 1),
    ("elastic DP", "elastic_dp", 1),
    ("Decoupled M=2", "decoupled", 2),
    ("Decoupled M=4", "decoupled", 4),
    ("Decoupled M=8", "decoupled", 8),
    ("Decoupled M=16", "decoupled", 16),
)
# arXiv 2604.21428 (design.md section 4): goodput at 1.2M chips, chip MTBF 1 year.
PAPER_1P2M = {"DP": 0.27, "elastic DP": 0.58, "Decoupled M=2": 0.70, "Decoupled M=4": 0.82}
PAPER_1P2M |= {"Decoupled M=8": 0.88, "Decoupled M=16": 0.93}
