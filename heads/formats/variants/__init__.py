"""The export formats of variants with a layout of their own (P-EAGLE, DSpark), beside their kind's format."""
