"""Where the ranks were and what they did: stacks, flight-recorder records, desync."""
