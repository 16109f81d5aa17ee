"""Generated gRPC stubs (scripts/gen_protos.sh at install time; never edited by hand)."""
