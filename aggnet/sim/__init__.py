"""``aggnet sim``: predictions of all-reduce and training-step times on
fabrics no lab owns (thousands of workers, Tofino-class switches), for
aggnet and its peers, from parameters with their sources."""
