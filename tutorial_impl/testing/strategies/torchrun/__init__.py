"""Under torchrun: this pytest worker as one rank of the job."""
