"""The benchmarks behind `npumoed bench`: they import the product; nothing in the product imports them."""
