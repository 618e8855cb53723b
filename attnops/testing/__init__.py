"""Independent dense goldens and the tolerance rule used to judge the attention operators."""
