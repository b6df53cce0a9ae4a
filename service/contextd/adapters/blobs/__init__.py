"""What both engines share for stored tool-output results: chunk encoding and row layout."""
