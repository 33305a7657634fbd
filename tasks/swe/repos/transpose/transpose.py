def transpose(rows):
    n = len(rows)
    return [[rows[j][i] for j in range(n)] for i in range(n)]
