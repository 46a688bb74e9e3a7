"""Partners: the licences they grant, who may write where, and the credits they are owed."""
