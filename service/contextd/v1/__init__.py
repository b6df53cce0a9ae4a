"""Generated gRPC code for the contextd.v1 package lands here (`make proto`); never committed."""
