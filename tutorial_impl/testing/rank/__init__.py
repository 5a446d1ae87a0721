"""What runs inside a rank: its first steps, its function, what it reports."""
