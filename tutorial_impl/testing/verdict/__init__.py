"""Every rank's report in, one verdict out, and every sentence a report says."""
